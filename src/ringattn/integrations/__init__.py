"""Integrations: drop-ins for other libraries' interfaces.

context_parallel.py is torch's experimental context manager of the same name; hf/ (next) plugs
into Hugging Face transformers' attention interface.
"""
