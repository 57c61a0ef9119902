"""Insertion scores from keys and values for the simulator (:class:`.simulate.MaskedArm` with
``with_values=True``): the calibrated filter's projection, each token's value norm and its key's
novelty (KeyDiff), alone or mixed. Each is fixed when the token enters the cache and needs only
the keys and values of that token and of the tokens before it, so a streaming cache could compute
it (what it would store: a running mean of the keys and running moments per head).

Components, per layer, KV head ``h`` and token ``t`` (keys post-RoPE, as cached):

* ``filter``: the Q-Filters score ``sign * <k_t, u_h>`` (the default's);
* ``value``: ``log ||v_t||``, how much the token moves the output when it is attended;
* ``novelty``: ``-cos(k_t, mean(k_0..k_t))``, KeyDiff's score with the mean of the keys seen so
  far as the anchor (KeyDiff anchors on the keys held; the mean of all keys seen is its
  fixed-at-insertion form): keys unlike the rest are kept.

A mix is ``sum_c w_c * z_c(t)`` with ``z_c`` the component standardized by its own mean and
standard deviation over tokens ``0..t`` of that head (running moments: scales differ by
component and head); one component alone is used as computed (its ranks unchanged).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from qfilters_mlx.backends import reference
from qfilters_mlx.evaluation.simulate import MaskedArm

__all__ = ["COMPONENTS", "components", "kv_score", "kv_score_arm"]

COMPONENTS = ("filter", "value", "novelty")


def _running_z(x: np.ndarray) -> np.ndarray:
    """``[H, T]``: each ``x[:, t]`` standardized by the mean and std of ``x[:, :t + 1]``
    (0 where that std is 0)."""
    n = np.arange(1, x.shape[1] + 1)
    m1 = np.cumsum(x, axis=1) / n
    m2 = np.cumsum(x * x, axis=1) / n
    sd = np.sqrt(np.maximum(m2 - m1 * m1, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sd > 1e-12, (x - m1) / sd, 0.0)


def components(keys, values, filters=None, sign: int = 1) -> dict:
    """``{name: [H, T] float64}`` of each :data:`COMPONENTS` entry for one layer's ``keys``
    ``[H, T, D]`` and ``values`` ``[H, T, D_v]`` (``filter`` only when ``filters [H, D]`` given)."""
    k = np.asarray(keys, np.float64)
    v = np.asarray(values, np.float64)
    out = {"value": np.log(np.maximum(np.linalg.norm(v, axis=-1), 1e-12))}
    anchor = np.cumsum(k, axis=1) / np.arange(1, k.shape[1] + 1)[None, :, None]
    cos = (k * anchor).sum(-1) / np.maximum(np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor, axis=-1), 1e-12)
    out["novelty"] = -cos
    if filters is not None:
        s = reference.projection_scores(mx.array(k[None].astype(np.float32)), mx.array(filters), sign)
        out["filter"] = np.array(s[0]).astype(np.float64)
    return out


def kv_score(weights: dict, filters=None, sign: int = 1):
    """``score(layer, keys [1, H, T, D], values [1, H, T, D_v]) -> [1, H, T]`` of the mix
    ``weights`` (``{component: weight}``, module docstring), for :class:`MaskedArm`.

    Raises:
        ValueError: an unknown component or no weight; ``filter`` without ``filters``.
    """
    if not weights or set(weights) - set(COMPONENTS):
        raise ValueError(f"weights: some of {COMPONENTS}, got {weights}")
    if "filter" in weights and filters is None:
        raise ValueError("the filter component needs filters [n_layers, H_kv, D]")

    def score(layer, keys, values):
        f = None if filters is None or "filter" not in weights else np.asarray(filters[layer], np.float32)
        c = components(np.array(keys[0].astype(mx.float32)), np.array(values[0].astype(mx.float32)), f, sign)
        if len(weights) == 1:
            (name, w), = weights.items()
            s = w * c[name]
        else:
            s = sum(w * _running_z(c[name]) for name, w in weights.items())
        return mx.array(s.astype(np.float32))[None]

    return score


def kv_score_arm(config, weights: dict, filters=None, **fields) -> MaskedArm:
    """A :class:`MaskedArm` of ``config``'s keep rule scoring by :func:`kv_score` (``fields``:
    ``budgets``, ``recents``)."""
    return MaskedArm(config, score=kv_score(weights, filters, config.score_sign), with_values=True, **fields)
