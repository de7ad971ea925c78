"""``streamer.hf`` is ``streamer.model.hf``: the name the model integration had before the
layout split, kept so existing callers keep working."""
import sys

from streamer.model import hf as _hf

sys.modules[__name__] = _hf
