from services.frontend.server import main

raise SystemExit(main())
