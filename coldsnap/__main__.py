from coldsnap.cli import main

raise SystemExit(main())
