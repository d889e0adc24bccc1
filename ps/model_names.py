"""The ``--model`` names every ``ltp-ps`` command accepts, checked without building a model, so ``launch``
refuses a bad name when it parses its command line, before it spawns a process."""

from __future__ import annotations

from .errors import ConfigError

#: parameter counts of the named synthetic models (``ltp_ps.workloads.SyntheticWorkload``)
SYNTHETIC_SIZES = {"resnet50": 25_557_032, "vgg16": 138_357_544}
#: the largest ``synthetic:<n>``: 2**31 float32 (8 GiB per copy), beyond what a PS here should allocate
MAX_SYNTHETIC_PARAMS = 2 ** 31


def synthetic_params(name: str) -> int | None:
    """The parameter count of model ``name``: None for ``digits`` (a real model), the size of a key of
    :data:`SYNTHETIC_SIZES`, or ``n`` of ``synthetic:<n>`` (a whole ``n`` in 1..:data:`MAX_SYNTHETIC_PARAMS`);
    else :class:`ConfigError` naming the accepted forms."""
    if name == "digits":
        return None
    if name in SYNTHETIC_SIZES:
        return SYNTHETIC_SIZES[name]
    if name.startswith("synthetic:"):
        try:
            n = float(name.split(":", 1)[1])
        except ValueError:
            n = float("nan")
        if not (1 <= n <= MAX_SYNTHETIC_PARAMS and n == int(n)):  # NaN fails the first test
            raise ConfigError(f"bad model {name!r}: synthetic:<n> needs a whole number of parameters in "
                              f"1..{MAX_SYNTHETIC_PARAMS} (such as synthetic:1e6)")
        return int(n)
    raise ConfigError(f"unknown model {name!r}; use digits, resnet50, vgg16 or synthetic:<n_params>")
