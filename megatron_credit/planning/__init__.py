"""The memory planner: does a recipe's layout fit its cluster (``plan``), which layouts would
(``layouts``), and the GPU kinds a recipe may be sized for (``gpu_kinds``)."""
