from services.worker.server import main

raise SystemExit(main())
