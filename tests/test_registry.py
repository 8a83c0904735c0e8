"""Specification of the recipe registry: decorator and function registration, folders, entry points, errors."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

import pytest

import accel_trainer as at
from accel_trainer import registry
from accel_trainer.errors import RecipeError
from conftest import REPO

RECIPES_DIR = REPO / "recipes"


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch, tmp_path):
    """Give each test its own copy of the module-global registry, and forget the recipe modules it imported.

    Both halves are needed: a recipe module left in sys.modules is never imported again, so its decorator
    would not re-register it into a restored registry.
    """
    monkeypatch.setattr(registry, "_recipes", dict(registry._recipes))
    monkeypatch.setattr(registry, "_discovered", registry._discovered)
    modules_before = set(sys.modules)
    yield
    for name in set(sys.modules) - modules_before:
        module_file = getattr(sys.modules[name], "__file__", None) or ""
        if name.startswith("accel_trainer_recipes.") or Path(module_file).resolve().is_relative_to(tmp_path.resolve()):
            del sys.modules[name]


def write_module(folder: Path, name: str, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def make_distribution(root: Path, entry_points: str) -> None:
    """A fake installed package `fakepkg` declaring `entry_points` in the group accel_trainer.recipes."""
    dist_info = root / "fakepkg-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{textwrap.dedent(entry_points)}")


# --- programmatic registration ---------------------------------------------------------------------------------


def test_the_decorator_registers_a_recipe_class_under_its_name_and_returns_the_class():
    class Decorated(at.Recipe):
        """Registered by decorator."""

    assert at.register_recipe("decorated_demo")(Decorated) is Decorated
    assert at.get_recipe("decorated_demo") is Decorated


def test_add_recipe_is_the_function_form_of_the_decorator():
    class Added(at.Recipe):
        """Registered by function."""

    at.add_recipe("added_demo", Added)
    assert at.get_recipe("added_demo") is Added
    assert at.registered_recipes()["added_demo"] is Added


def test_a_name_registered_by_two_different_classes_is_a_recipe_error_naming_both():
    class First(at.Recipe):
        pass

    class Second(at.Recipe):
        pass

    at.add_recipe("taken_demo", First)
    with pytest.raises(RecipeError, match="'taken_demo' is registered twice") as caught:
        at.add_recipe("taken_demo", Second)
    assert "First" in str(caught.value) and "Second" in str(caught.value)
    assert at.get_recipe("taken_demo") is First


def test_registering_the_same_class_twice_is_not_an_error():
    class Twice(at.Recipe):
        pass

    at.add_recipe("twice_demo", Twice)
    at.add_recipe("twice_demo", Twice)
    assert at.get_recipe("twice_demo") is Twice


def test_the_same_recipe_file_imported_under_two_module_names_is_not_a_duplicate(tmp_path):
    # What happens when `python recipes/x.py` runs the file as __main__ and discovery imports it again.
    path = write_module(
        tmp_path,
        "script_recipe",
        """
        import accel_trainer as at

        @at.register_recipe("script_demo")
        class ScriptRecipe(at.Recipe):
            pass
        """,
    )
    for module_name in ("script_as_main", "script_as_module"):
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    recipe_cls = at.get_recipe("script_demo")  # no duplicate error on the second import
    assert recipe_cls.__qualname__ == "ScriptRecipe"
    assert Path(inspect.getsourcefile(recipe_cls)) == path


@pytest.mark.parametrize("not_a_recipe", [object, dict, "vae", None])
def test_only_recipe_subclasses_can_be_registered(not_a_recipe):
    with pytest.raises(RecipeError, match="must be a subclass of accel_trainer.Recipe"):
        at.add_recipe("bad_demo", not_a_recipe)
    assert "bad_demo" not in registry._recipes


# --- unknown names and descriptions ----------------------------------------------------------------------------


def test_an_unknown_name_is_a_recipe_error_listing_the_known_names_with_a_close_match():
    class Alpha(at.Recipe):
        pass

    class Beta(at.Recipe):
        pass

    at.add_recipe("alpha_demo", Alpha)
    at.add_recipe("beta_demo", Beta)
    with pytest.raises(RecipeError) as caught:
        at.get_recipe("alpha_dmeo")
    message = str(caught.value)
    assert "unknown recipe 'alpha_dmeo'" in message
    assert "did you mean 'alpha_demo'?" in message
    assert "known recipes: " in message and "alpha_demo" in message and "beta_demo" in message
    assert "\n" not in message


def test_an_unknown_name_with_no_close_match_still_lists_the_known_names():
    class Gamma(at.Recipe):
        pass

    at.add_recipe("gamma_demo", Gamma)
    with pytest.raises(RecipeError) as caught:
        at.get_recipe("zzzzzzzzzzzz")
    assert "did you mean" not in str(caught.value)
    assert "gamma_demo" in str(caught.value)


def test_describe_gives_the_first_line_of_the_recipe_docstring():
    class Documented(at.Recipe):
        """Train a documented demo.

        More detail that `accel-trainer list` does not show.
        """

    assert registry.describe(Documented) == "Train a documented demo."


def test_describe_of_an_undocumented_recipe_is_empty_not_the_base_class_docstring():
    class Undocumented(at.Recipe):
        pass

    assert registry.describe(Undocumented) == ""


# --- folder discovery ------------------------------------------------------------------------------------------


def test_discover_recipes_imports_every_module_of_a_folder_and_skips_underscore_files(tmp_path):
    folder = tmp_path / "recipes"
    write_module(
        folder,
        "folder_demo",
        '''
        import accel_trainer as at

        @at.register_recipe("folder_demo")
        class FolderDemo(at.Recipe):
            """A recipe found in a folder."""
        ''',
    )
    write_module(folder, "_private", "raise AssertionError('files starting with _ are not recipes')")

    registry.discover_recipes([folder])

    recipe_cls = at.get_recipe("folder_demo")
    assert recipe_cls.__name__ == "FolderDemo"
    assert Path(inspect.getsourcefile(recipe_cls)) == folder / "folder_demo.py"


def test_discovering_a_folder_twice_registers_its_recipes_once(tmp_path):
    folder = tmp_path / "recipes"
    write_module(
        folder,
        "again_demo",
        """
        import accel_trainer as at

        @at.register_recipe("again_demo")
        class AgainDemo(at.Recipe):
            pass
        """,
    )
    registry.discover_recipes([folder])
    first = at.get_recipe("again_demo")
    registry.discover_recipes([folder])
    assert at.get_recipe("again_demo") is first


SAME_STEM_RECIPE = """
import accel_trainer as at
from conftest import REPO

@at.register_recipe("{name}")
class SameStem(at.Recipe):
    pass
"""


def test_two_recipe_folders_with_a_file_of_the_same_name_are_a_recipe_error_naming_both(tmp_path):
    first = write_module(tmp_path / "a" / "recipes", "same_stem", SAME_STEM_RECIPE.format(name="stem_a"))
    second = write_module(tmp_path / "b" / "recipes", "same_stem", SAME_STEM_RECIPE.format(name="stem_b"))

    with pytest.raises(RecipeError, match="have the same name") as caught:
        registry.discover_recipes([first.parent, second.parent])
    assert str(first) in str(caught.value) and str(second) in str(caught.value)


def test_the_same_file_in_two_recipe_folders_is_one_recipe(tmp_path):
    # an installed package's shipped copy of a recipe beside the checkout's ./recipes (pip install ., used there)
    first = write_module(tmp_path / "a" / "recipes", "copied_stem", SAME_STEM_RECIPE.format(name="stem_copied"))
    second = write_module(tmp_path / "b" / "recipes", "copied_stem", SAME_STEM_RECIPE.format(name="stem_copied"))

    registry.discover_recipes([first.parent, second.parent])
    assert "stem_copied" in at.registered_recipes()


def test_a_same_named_file_found_later_never_silently_replaces_a_registered_recipe(tmp_path):
    # Modules are keyed by their full path: the second file's class cannot pass for the first's.
    first = write_module(tmp_path / "a" / "recipes", "replaced_stem", SAME_STEM_RECIPE.format(name="stem_kept"))
    second = write_module(tmp_path / "b" / "recipes", "replaced_stem", SAME_STEM_RECIPE.format(name="stem_kept"))
    registry.discover_recipes([first.parent])

    with pytest.raises(RecipeError, match="registered twice") as caught:
        registry.discover_recipes([second.parent])
    assert str(first.resolve()) in str(caught.value) and str(second.resolve()) in str(caught.value)


def test_a_recipe_file_that_fails_to_import_is_a_recipe_error_naming_the_file(tmp_path):
    path = write_module(tmp_path / "recipes", "broken_demo", "import a_module_that_does_not_exist\n")
    with pytest.raises(RecipeError, match="failed to import") as caught:
        registry.discover_recipes([path.parent])
    assert str(path) in str(caught.value)


def test_a_recipe_file_named_by_path_imports_the_modules_beside_it_as_python_would(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    helper = f"helpers_{tmp_path.name}"  # a name of this test's own: a module once imported stays in sys.modules
    (tmp_path / f"{helper}.py").write_text("HIDDEN = 7\n")
    recipe = write_module(
        tmp_path,
        "sibling_demo",
        f"""
        import accel_trainer as at
        from {helper} import HIDDEN

        @at.register_recipe("sibling_demo")
        class SiblingDemo(at.Recipe):
            hidden = HIDDEN
    """,
    )
    assert registry.recipe_name_of(str(recipe)) == "sibling_demo"
    assert registry.get_recipe("sibling_demo").hidden == 7
    assert sys.path[-1] == str(tmp_path)  # appended: a file named like an installed module never shadows it


def folder_of(recipe_cls: type) -> Path | None:
    """The folder of the file a recipe is defined in; None for one with no file (a notebook cell another test
    registered in this process)."""
    try:
        return Path(inspect.getsourcefile(recipe_cls) or "").resolve().parent
    except (OSError, TypeError):
        return None


def test_the_checkout_recipes_folder_is_discovered_with_one_recipe_per_file():
    registry.discover_recipes([RECIPES_DIR])

    recipe_files = sorted(p for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))
    from_folder = sorted(name for name, recipe_cls in registry._recipes.items() if folder_of(recipe_cls) == RECIPES_DIR)
    assert len(from_folder) == len(recipe_files)
    # A new recipe must update this count: the test then proves the new file is really discovered.
    assert len(from_folder) == 11
    assert from_folder == [
        "dpo", "gan", "gpt", "grpo", "hf_causal_lm", "hf_finetune", "mlp", "resnet", "sft_chat", "sketched", "vae",
    ]  # fmt: skip


def test_default_discovery_includes_the_checkout_recipes_folder():
    assert registry.recipes_folder().resolve() == RECIPES_DIR
    assert "vae" in at.registered_recipes()


# --- entry points ------------------------------------------------------------------------------------------------


def test_an_entry_point_naming_a_module_registers_the_recipes_its_decorators_declare(tmp_path, monkeypatch):
    write_module(
        tmp_path,
        "fakepkg_module_recipes",
        '''
        import accel_trainer as at

        @at.register_recipe("from_module_demo")
        class FromModule(at.Recipe):
            """Registered on import by an installed package."""
        ''',
    )
    make_distribution(tmp_path, "anything = fakepkg_module_recipes\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    registry._load_entry_points()

    assert at.get_recipe("from_module_demo").__name__ == "FromModule"
    assert "anything" not in registry._recipes  # a module entry point's own name is not a recipe


def test_an_entry_point_naming_a_recipe_class_registers_it_under_the_entry_point_name(tmp_path, monkeypatch):
    write_module(
        tmp_path,
        "fakepkg_class_recipes",
        '''
        import accel_trainer as at

        class FromClass(at.Recipe):
            """Registered by its entry point."""
        ''',
    )
    make_distribution(tmp_path, "from_class_demo = fakepkg_class_recipes:FromClass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    registry.discover_recipes([])

    assert at.get_recipe("from_class_demo").__name__ == "FromClass"


def test_an_entry_point_naming_something_other_than_a_module_or_recipe_is_a_recipe_error(tmp_path, monkeypatch):
    write_module(tmp_path, "fakepkg_not_recipes", "class NotARecipe:\n    pass\n")
    make_distribution(tmp_path, "not_a_recipe = fakepkg_not_recipes:NotARecipe\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(RecipeError, match="must name a module or a Recipe subclass"):
        registry._load_entry_points()


def test_an_entry_point_that_fails_to_load_is_a_recipe_error_naming_it(tmp_path, monkeypatch):
    make_distribution(tmp_path, "missing_demo = fakepkg_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(RecipeError, match="entry point 'missing_demo'.*failed to load"):
        registry._load_entry_points()


def test_a_recipe_file_may_build_on_another_of_its_folder_whatever_their_order(tmp_path):
    """dpo.py builds on hf_finetune.py, which discovery imports after it (files are imported in name order)."""
    write_module(tmp_path, "a_child", "import accel_trainer as at\nParent = at.get_recipe('z_parent')\n"
                 "@at.register_recipe('a_child')\nclass Child(Parent):\n    hidden = 2\n")  # fmt: skip
    write_module(tmp_path, "z_parent", "import accel_trainer as at\n@at.register_recipe('z_parent')\n"
                 "class Parent(at.Recipe):\n    hidden = 1\n")  # fmt: skip
    registry.discover_recipes([tmp_path])
    assert registry.get_recipe("a_child").hidden == 2 and registry.get_recipe("z_parent").hidden == 1
