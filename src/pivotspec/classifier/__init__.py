"""The pivot classifier: what PAD asks at every draft token it could keep.

Owns the networks, their inputs and their files (``model``: one ``model_inputs`` for training and decoding),
features of labeled candidates (``features``), training with sigma calibration (``training``) and the
binary-classifier metrics and plots (``metrics``). It imports the decoding core, the labels files and the base;
never evaluation or an entry point.
"""
