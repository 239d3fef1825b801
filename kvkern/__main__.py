from kvkern.cli import main

raise SystemExit(main())
