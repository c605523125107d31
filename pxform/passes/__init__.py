"""Floor 5, passes: graph to graph, before any cost or plan.

    propagate  the conversion rule's layouts (G, C) and greedy strategy propagation
    cuts       stage cuts from markers, and graph sharding into blocks (Merak)
    coshard    a coshard region -> one recomputed copy per piece
    expand     region expansion: strip markers, expand coshard, number recompute regions

May import core, schedules, ops and frontend.
"""
