"""What autocast does for the frameworks' objects: NNX objects among a call's arguments (``nnx_nodes``), and an
NNX or Equinox module as the function (``modules``)."""
