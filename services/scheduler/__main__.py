from services.common.threads import limit_control_process_threads

limit_control_process_threads()  # NOTE: before the server's imports load torch

from services.scheduler.server import main  # noqa: E402

raise SystemExit(main())
