"""``python -m train``: data-parallel training with SparDL; with no flags, the main job."""

import sys

from train.main import main

sys.exit(main())
