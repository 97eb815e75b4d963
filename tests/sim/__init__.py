"""Tests of psrl.sim (the discrete-event simulator)."""
