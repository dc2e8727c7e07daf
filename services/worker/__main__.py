from services.common.threads import configure_worker_threads

configure_worker_threads()  # NOTE: before the server's imports load torch

from services.worker.server import main  # noqa: E402

raise SystemExit(main())
