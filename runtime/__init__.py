"""The lean runtime: engine sessions, prompts, the decode loop and its rules, wav output.

Imports no torch, onnx or polygraphy: a deployment installs only what this package needs.
"""
