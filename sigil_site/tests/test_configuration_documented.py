"""Every environment variable settings.py reads is documented in .env.example and in docs/configuration.md."""

import re

from django.conf import settings

SETTINGS_SOURCE = (settings.BASE_DIR / "sigil_site" / "settings.py").read_text()
ENV_READ = r"""(?:env_(?:str|int|float|bool|secret)|os\.environ\.get)\(\s*["']([A-Z0-9_]+)["']"""
READ = set(re.findall(ENV_READ, SETTINGS_SOURCE))


def test_settings_read_the_variables_this_test_looks_for():
    assert {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "SIGIL_BACKEND"} <= READ


def test_every_variable_has_one_line_in_env_example():
    example = (settings.BASE_DIR / ".env.example").read_text()
    counts = {name: len(re.findall(rf"^# {name}=", example, flags=re.MULTILINE)) for name in READ}
    assert {name: count for name, count in counts.items() if count != 1} == {}


def test_every_variable_is_in_the_configuration_table():
    page = (settings.BASE_DIR / "docs" / "configuration.md").read_text()
    assert sorted(name for name in READ if not re.search(rf"^\| `{name}` \|", page, flags=re.MULTILINE)) == []
