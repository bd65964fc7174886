"""TensorFlow's and Keras' internals, each imported and reached once, here.

``tf`` holds what tfpar takes from ``tensorflow.python`` and
``tensorflow.core`` (and checks the TensorFlow version at import); ``keras``
what it takes from ``keras.src``. Every private member tfpar touches is read
or called through a function of one of them, named for what it does, so a
TensorFlow upgrade is a change to these two modules.
"""
