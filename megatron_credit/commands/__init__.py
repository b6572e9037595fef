"""The installed command-line programs (``mc-plan``, ``mc-convert-hf-to-megatron``, ...; ``setup.py``'s
console scripts). Each module's ``main(argv=None)`` returns the exit code; ``tools/<name>.py`` runs the same
``main`` from a checkout, and ``python -m megatron_credit.commands.<name>`` does too."""
