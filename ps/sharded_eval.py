"""Test accuracy of a sharded model: every shard hands its slice to shard 0 through the store.

With ``--num-servers K > 1`` no shard holds the whole model, so none could evaluate it and a run
printed no accuracy at all (and the chance-accuracy verdict never judged it).  At the end of each
epoch every shard ``s > 0`` writes its parameter slice to the job's rendezvous store under
``eval/<epoch>/<s>``, MAC'd with the job secret over (shard, epoch, bytes); shard 0 waits (bounded)
for the K−1 slices, checks their MACs and sizes, assembles the model and evaluates it, then deletes
the keys.

Choices:

* Only for workloads that are judged (``chance_accuracy`` set: digits and ``--model`` CNNs); a
  synthetic model has nothing to evaluate.
* Only for models up to ``MAX_EVAL_BYTES``: the store is a control channel, not a bulk path.
* The shards finish an epoch within about one round of each other (every worker waits for every
  shard's parameters before its next round), so shard 0 waits at most ``EVAL_WAIT_S`` (blocking its
  loop for that long only when a shard is gone, and then the job is failing anyway).  A slice that
  does not come, or comes with a bad MAC or size, skips that epoch's evaluation with a logged reason;
  it never fails the job by itself.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import struct

import numpy as np

#: bytes: the largest model whose slices travel through the store for an evaluation
MAX_EVAL_BYTES = 64 * 1024 * 1024
#: seconds shard 0 waits for the other shards' slices of one epoch
EVAL_WAIT_S = 10.0
_MAC_BYTES = 32


def _key(epoch: int, shard: int) -> str:
    return f"eval/{int(epoch)}/{int(shard)}"


def _mac(secret: bytes, shard: int, epoch: int, body: bytes) -> bytes:
    return hmac.new(secret, b"eval|" + struct.pack("!qq", shard, epoch) + body, hashlib.sha256).digest()


def eligible(workload, n_params: int) -> bool:
    """True when this job's model is judged and small enough to assemble through the store."""
    return getattr(workload, "chance_accuracy", None) is not None and 4 * int(n_params) <= MAX_EVAL_BYTES


def publish_slice(store, secret: bytes, shard: int, epoch: int, params: np.ndarray) -> None:
    """Shard ``shard`` (> 0): hand this epoch's parameter slice to shard 0."""
    body = np.ascontiguousarray(params, dtype=np.float32).tobytes()
    store.set(_key(epoch, shard), _mac(secret, shard, epoch, body) + body)


def assemble(store, secret: bytes, ranges, own: np.ndarray, epoch: int, *,
             wait_s: float = EVAL_WAIT_S) -> tuple[np.ndarray | None, str | None]:
    """Shard 0: the whole model of ``epoch`` (``own`` is shard 0's slice), or ``(None, reason)``."""
    keys = [_key(epoch, s) for s in range(1, len(ranges))]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except Exception:  # torch raises DistStoreError/RuntimeError on a timeout
        missing = [k for k in keys if not store.check([k])] or keys
        return None, f"shard slices {', '.join(missing)} did not arrive within {wait_s:g} s"
    lo0, hi0 = ranges[0]
    full = np.empty(ranges[-1][1], dtype=np.float32)
    full[lo0:hi0] = own
    try:
        for s, key in enumerate(keys, start=1):
            blob = store.get(key)
            mac, body = bytes(blob[:_MAC_BYTES]), bytes(blob[_MAC_BYTES:])
            lo, hi = ranges[s]
            if not hmac.compare_digest(mac, _mac(secret, s, epoch, body)):
                return None, f"shard {s}'s slice failed authentication (a different job secret?)"
            if len(body) != 4 * (hi - lo):
                return None, f"shard {s}'s slice has {len(body)} bytes, expected {4 * (hi - lo)}"
            full[lo:hi] = np.frombuffer(body, dtype=np.float32)
    finally:
        for key in keys:
            try:
                store.delete_key(key)
            except Exception:  # an absent key: nothing to clean up
                pass
    return full, None
