import sys

from jlora.cli import main

sys.exit(main())
