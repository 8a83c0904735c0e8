"""Follow the recipe object through one short training run and count how the reading jumps between files.

Structure v4's measure of the engine's shape: a profile hook sees every call of a function of `accel_trainer/`
whose frame holds the recipe (a local, or a local's attribute: `run.recipe`, `self.recipe`) during a 1-process
VAE run of 2 steps with an evaluation, and every call such a frame makes into the package (the reader steps into
each callee). Each function counts once, at its first call, as a reader reads it once. The files those calls
enter, in order (consecutive calls in one file read as one visit), give:
  - returns: visits to a file read earlier in the walk (the reader goes back);
  - observer: visits to observe/observer.py;
  - files: the distinct files the walk reads.
Run from the checkout: `OMP_NUM_THREADS=1 .venv/bin/python scripts/walk_recipe.py` (-v: the files in order; -f:
each function entered and its caller). Structure v3's tree (3622447): 79 returns, 11 observer visits; v4: 45, 3.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import accel_trainer as at

PACKAGE = Path(at.__file__).parent


def holds(frame, recipe) -> bool:
    """Whether the frame holds the recipe: as a local, or as an attribute of one (`run.recipe`, `self.recipe`)."""
    for value in frame.f_locals.values():
        if value is recipe:
            return True
        try:
            attributes = vars(value)
        except TypeError:
            attributes = {name: getattr(value, name, None) for name in getattr(type(value), "__slots__", ())}
        if any(attribute is recipe for attribute in attributes.values()):
            return True
    return False


def main() -> None:
    visits: list[str] = []
    recipe_box: list[object] = []
    read: set[object] = set()
    original_init = at.Recipe.__init__

    def remember(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        recipe_box.append(self)

    at.Recipe.__init__ = remember  # type: ignore[method-assign]

    def profile(frame, event, arg):
        if event != "call" or not recipe_box:
            return
        file = frame.f_code.co_filename
        if not file.startswith(str(PACKAGE)):
            return
        caller = frame.f_back
        if not holds(frame, recipe_box[-1]) and not (caller is not None and holds(caller, recipe_box[-1])):
            return
        if frame.f_code in read:  # a reader reads each function once, however often it runs
            return
        read.add(frame.f_code)
        name = str(Path(file).relative_to(PACKAGE))
        if "-f" in sys.argv:
            print("VISIT", name, frame.f_code.co_name, "<-", caller.f_code.co_name if caller else None)
        if not visits or visits[-1] != name:
            visits.append(name)

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            at.train("vae", max_steps=2, eval_every_steps=2, log_every_steps=1, output_dir=out)
        finally:
            sys.setprofile(None)
    seen: set[str] = set()
    returns = 0
    for name in visits:
        returns += name in seen
        seen.add(name)
    print(
        f"visits {len(visits)}, returns to an earlier file {returns},"
        f" observer entered {visits.count('observe/observer.py')}, files {len(seen)}"
    )
    if "-v" in sys.argv:
        print(" -> ".join(visits))


if __name__ == "__main__":
    main()
