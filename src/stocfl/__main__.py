from stocfl.cli import main

raise SystemExit(main())
