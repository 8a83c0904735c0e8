"""Test worker: say whether the environment names the launch's config file, and what accel-trainer finds.

Prints, in one write per process: "env-mentions <N> found <path or None>".
"""

import os
import sys

from accel_trainer.parallel.launch_fixes import launch_config_path

config_name = sys.argv[1]
mentions = sum(config_name in value for value in os.environ.values())
os.write(1, f"env-mentions {mentions} found {launch_config_path()}\n".encode())
