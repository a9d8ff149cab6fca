"""Lossy (approximate) modes, kept apart and named as such.

Nothing here keeps hasten's lossless contract: output may differ from the plain model's.
Each mode says what it trades and is off unless asked for by name.
"""
from .kv import SnapKV, SpecKV, StreamingLLM
from .specpc import SpecPC
from .gadpp import GADPlusPlus
from .typical import TypicalAcceptance

__all__ = ["GADPlusPlus", "SnapKV", "SpecKV", "SpecPC", "StreamingLLM", "TypicalAcceptance"]
