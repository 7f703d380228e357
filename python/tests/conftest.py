# Lets the tests run from a source checkout too: the package source first, unless megamoe is installed.
import importlib.util
import pathlib
import sys

if importlib.util.find_spec("megamoe") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
