"""User-facing errors.

Anything the user can fix (a bad override, an unknown recipe, a wrong layout) raises a subclass of
`UserError`. The command-line entry points print such an error as one line and exit with status 2 instead
of showing a traceback; genuine bugs still raise normally so they keep their traceback.
"""


class UserError(Exception):
    """A problem in what the user asked for; the message names the problem and the fix."""


class ConfigError(UserError):
    """A configuration key, value or file is wrong."""


class RecipeError(UserError):
    """A recipe is unknown, registered twice, or breaks the recipe contract."""


class LayoutError(UserError):
    """The processes that were started do not form the layout that was asked for."""
