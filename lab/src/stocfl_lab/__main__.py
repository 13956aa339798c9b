from stocfl_lab.cli import main

raise SystemExit(main())
