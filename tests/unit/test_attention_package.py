"""attention/'s package docstring lists exactly the modules the folder holds."""
import re
from pathlib import Path

import wan_sage.attention as attention

FOLDER = Path(attention.__file__).parent


def test_the_module_list_names_every_module_and_no_other():
    listed = set(re.findall(r"^(\w+) +\S", attention.__doc__.split("\n\n", 1)[1], flags=re.M))
    files = {p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__"}
    assert listed == files
