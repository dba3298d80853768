"""``python -m jaxrlhf.plan --compare``: the 70B experiments next to the seed figures."""

import sys

from jaxrlhf.plan.cli import _cli

sys.exit(_cli())
