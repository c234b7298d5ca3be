import sys

from reader.cli import main

sys.exit(main())
