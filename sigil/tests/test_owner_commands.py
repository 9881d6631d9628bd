"""The shell commands' base: help from the class's docstring, arguments declared as data."""

from sigil.owner_commands import CAPABILITY, OwnerCommand, SigilCommand, argument


class Greet(SigilCommand):
    """Greet someone
    by name."""

    arguments = (argument("name"), argument("--loud", action="store_true", help="in capitals"))


class Roll(OwnerCommand):
    """Roll a capability back."""

    help = "an explicit help wins"
    arguments = (CAPABILITY,)


def test_the_help_is_the_docstring_on_one_line_unless_given():
    assert Greet.help == "Greet someone by name."
    assert Roll.help == "an explicit help wins"


def test_the_declared_arguments_are_parsed_in_order_after_json():
    options = Greet().create_parser("manage.py", "greet").parse_args(["ada", "--loud"])
    assert (options.name, options.loud) == ("ada", True)
    parser = Roll().create_parser("manage.py", "roll")
    options = parser.parse_args(["alice--ping", "--json"])
    assert (options.capability, options.as_json) == ("alice--ping", True)
    names = [action.dest for action in parser._actions]
    assert names.index("as_json") < names.index("capability")
