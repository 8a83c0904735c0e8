"""`at.train(..., num_processes=N)`: train on N processes started from Python, as from a notebook.

accelerate's `notebook_launcher` forks N workers under torch's elastic launcher (so recipes defined in a
notebook or a script are known to them), each of which calls `at.train` and joins the process group; the
main worker writes its `TrainResult` to a file the caller reads back.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from .errors import UserError


def launch_processes(
    recipe_name: str, num_processes: int, config_file: str | Path | None, overrides: dict[str, Any]
) -> Any:
    """Run `at.train` on `num_processes` forked processes; returns the main process's TrainResult.

    Raises:
        UserError: num_processes is not a positive count, or this process already is a launched worker.
    """
    from accelerate import notebook_launcher

    from .accelerate_fixes import forget_accelerate_state, launched_world_size
    from .run import TrainResult

    if num_processes < 1:
        raise UserError(f"num_processes={num_processes}: must be at least 1")
    if launched_world_size() is not None:
        raise UserError(
            f"num_processes={num_processes} from a process a launcher started ({launched_world_size()} processes):"
            " set the process count in the launcher instead"
        )
    forget_accelerate_state()  # notebook_launcher refuses to fork once an Accelerator exists in this process
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "result.json"
        notebook_launcher(_worker, args=(recipe_name, config_file, overrides, str(result_file)),
                          num_processes=num_processes, use_port=str(_free_port()))  # fmt: skip
        if not result_file.is_file():
            raise UserError(f"training on {num_processes} processes ended without a result; see their output above")
        result = json.loads(result_file.read_text())
    return TrainResult(metrics=result["metrics"], run_dir=Path(result["run_dir"]))


def _worker(recipe_name: str, config_file: Any, overrides: dict[str, Any], result_file: str) -> None:
    from .run import train

    result = train(recipe_name, config_file=config_file, **overrides)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(result_file).write_text(json.dumps({"metrics": result.metrics, "run_dir": str(result.run_dir)}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
