"""The mpprof TensorBoard plugin: the "mpprof" tab.

Installed as `tensorboard_plugin_mpprof` and registered through the
`tensorboard_plugins` entry point (`plugin.MpprofPluginLoader`).
"""
