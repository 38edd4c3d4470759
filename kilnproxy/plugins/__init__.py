"""Plugins: the plugin manager, what plugins are told (``Call``), and the built-in plugins.

* ``manager``: loads the built-ins, the ``kilnproxy`` entry points and the
  config's modules, checks them, and calls hooks plugin by plugin so that an
  error names its plugin;
* ``call``: ``Call``, ``STOP`` and ``DROP``, what a hook sees of its request;
* ``builtin/``: features of the gateway written as plugins on the public hooks
  (``upstream_body``, ``pricing``), registered first under those names.

May import: the kernel (``kilnproxy.errors``, ``config``, ``usage``, ``sse``,
``hookspecs``, ...). Not the store, the fixtures, nor anything above.
"""
