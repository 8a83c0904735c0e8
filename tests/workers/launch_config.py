"""Test worker: say whether the environment names the launch's config file.

Prints, in one write per process: "env-mentions <N>".
"""

import os
import sys

config_name = sys.argv[1]
mentions = sum(config_name in value for value in os.environ.values())
os.write(1, f"env-mentions {mentions}\n".encode())
