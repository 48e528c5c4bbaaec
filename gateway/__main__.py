"""python -m gateway: the gateway service (see gateway.server)."""

from gateway.server import main

raise SystemExit(main())
