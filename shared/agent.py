"""Deprecated: the user SDK moved to `shared.sdk.agent`; this alias warns and goes away in the next release."""

import warnings

from shared.sdk.agent import *  # noqa: F403
from shared.sdk.agent import __all__  # noqa: F401

warnings.warn("shared.agent moved to shared.sdk.agent; import it from there (this alias goes away in the next "
              "release)", DeprecationWarning, stacklevel=2)
