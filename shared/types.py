"""Deprecated: the SDK's data types moved to `shared.sdk.types`; this alias warns and goes away in the next
release."""

import warnings

from shared.sdk.types import (  # noqa: F401
    Action,
    Episode,
    Step,
    TerminationReason,
    TokenSequence,
    Trajectory,
    compute_mc_returns,
)

warnings.warn("shared.types moved to shared.sdk.types; import it from there (this alias goes away in the next "
              "release)", DeprecationWarning, stacklevel=2)
