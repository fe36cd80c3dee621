"""Sphinx configuration of the gpytorch_iterncgp documentation.

Build (from the repository root; ``GPYTORCH_ITERNCGP_SMOKE=1`` runs the tutorials at their smoke-test sizes)::

    pip install -e ".[docs]"
    GPYTORCH_ITERNCGP_SMOKE=1 python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, also when another copy is installed
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gpytorch_iterncgp  # noqa: E402

project = "gpytorch_iterncgp"
author = "gpytorch_iterncgp contributors"
copyright = "the gpytorch_iterncgp contributors"
release = version = gpytorch_iterncgp.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "tutorials/README.rst", "tutorials/GALLERY_HEADER.rst", "**/*.ipynb", "**/*.py.md5"]

# MyST: Markdown pages with $...$ math, ::: fences and anchors for the headings (links like page.md#a-section).
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 4

# The docstrings are reStructuredText fields (:param x:, :math:`...`), so no napoleon.
autosummary_generate = True
autosummary_imported_members = False
# Members by where they are defined: a module's ``__all__`` re-exports (the top level, ``gpytorch_iterncgp.sklearn``, ...)
# are documented once, in their own module.
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # torch.nn.Module's and GPyTorch's inherited docstrings are not ours


def _skip_member(app, what, name, obj, skip, options):
    """scikit-learn's generated metadata-routing methods (``set_fit_request``, ...) are not ours."""
    if name.startswith("set_") and name.endswith("_request"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_member)


SMOKE = os.environ.get("GPYTORCH_ITERNCGP_SMOKE", "0") not in ("", "0")
sphinx_gallery_conf = {
    "examples_dirs": ["tutorials"],
    "gallery_dirs": ["auto_tutorials"],
    "filename_pattern": r"/plot_",  # every tutorial is executed at build time
    "ignore_pattern": r"/_",
    "within_subsection_order": "FileNameSortKey",
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "reset_modules": ("matplotlib", "seaborn"),
    "show_memory": False,
    "plot_gallery": "True",
}

html_theme = "furo"
html_title = f"gpytorch_iterncgp {release}"
html_static_path: list[str] = []

nitpicky = False
