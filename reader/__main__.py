import sys

from reader.cli.main import main

sys.exit(main())
