"""What an RL algorithm is: its registration (``spec``), its typed parameters (``params``), the metric tables
of what it logs (``metric_tables``), the critic kinds and gate controls a recipe selects (``critic_kinds``,
``gate_controls``), and the ``--plugin`` loader through which a user registers one (``plugins``)."""
