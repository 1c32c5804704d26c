"""shard.observe.tui: ``shard monitor``, the live view of a ring, in a terminal (Textual).

    state.py    the pure fold: feed events -> ``MonitorState``; value formatting
    app.py      MonitorApp: the screen, its bindings, ``show(event)``
    feed.py     FeedWatcher (Trio): dial the coordinator as a monitor, follow its status
                feed (``shard.observe.status``), reconnect forever
    guest.py    TrioGuest: the Trio side runs as a guest of Textual's asyncio loop; why
                that and not a thread is told there
    main.py     the entry points: ``shard monitor`` and ``shard swarm up --monitor``

Fixed snapshots for its tests, snapshot tests and demos are ``shard.testing.snapshots``.

Light like ``shard.wire``: importing any of it never imports torch. Nothing here imports
Textual but ``app.py`` and ``main.py``.
"""
