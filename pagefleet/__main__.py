from pagefleet.cli import main

raise SystemExit(main())
