"""`python -m gateway` (started by the supervisor in `appserver serve`)."""

from gateway.main import main

raise SystemExit(main())
