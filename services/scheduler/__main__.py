from services.scheduler.server import main

raise SystemExit(main())
