"""flexplan's Triton kernels, imported as flexplan.kernels_src (installed inside the flexplan
package; in a source checkout this top-level directory, mapped there by pyproject.toml).

The mapping must never pair flexplan with the kernels of another checkout (an editable install
maps flexplan.kernels_src to its own tree even when flexplan itself comes from elsewhere on
sys.path): a binary's key, the launch arguments and the kernels would then disagree silently.
So the two must sit together: this directory inside flexplan's (installed) or beside it (a
checkout)."""
import os as _os
import sys as _sys

_flexplan = getattr(_sys.modules.get(__name__.rpartition(".")[0]), "__file__", None)
if _flexplan is not None:
    _package = _os.path.dirname(_os.path.realpath(_flexplan))
    _here = _os.path.dirname(_os.path.realpath(__file__))
    if _os.path.dirname(_here) not in (_package, _os.path.dirname(_package)):
        raise ImportError(f"flexplan.kernels_src resolved to {_here}, which is not the kernels of "
                          f"the flexplan package at {_package}: two checkouts are mixed on "
                          "sys.path (install that checkout, or give its flexplan directory a kernels_src of its own, as an installed package has)")
