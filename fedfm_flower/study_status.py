"""``python -m fedfm_flower.study_status``: where a tuning directory stands
(``fedfm_flower.study.status``)."""

import sys

from fedfm_flower.study.status import main

if __name__ == "__main__":
    sys.exit(main())
