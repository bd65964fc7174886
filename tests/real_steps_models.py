"""The training programs of ``real_steps_script.py`` (see its docstring), as
keras-io writes them, at small sizes. Each scenario function trains once and
returns (every logged value, every variable in a fixed order)."""
import numpy as np
import tensorflow as tf

keras = tf.keras
LATENT = 4


def _rows(count: int, width: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).rand(count, width).astype(np.float32)


def _values(*objects) -> list:
    """Every variable of ``objects`` (models, optimizers, metrics), in order."""
    found = []
    for obj in objects:
        variables = obj.variables() if callable(getattr(obj, "variables", None)) else obj.variables
        found += [v.numpy() for v in variables]
    return found


def _dense_net(inputs: int, hidden: int, outputs: int, activation=None) -> keras.Model:
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(hidden, "relu"),
                             keras.layers.Dense(outputs, activation)])


class GAN(keras.Model):
    """keras-io's DCGAN ``GAN`` (its train_step as written; the latent vectors
    come with the batch)."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator

    def compile(self, d_optimizer, g_optimizer, loss_fn):  # pylint: disable=arguments-differ
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, data):
        real_images, random_latent_vectors = data
        batch_size = tf.shape(real_images)[0]
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * tf.tile([[0.5]], tf.shape(labels))  # the guide's noise, made fixed
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def _gan_parts():
    return _dense_net(6, 8, 1), _dense_net(LATENT, 8, 6, "sigmoid")


def gan_fit():
    discriminator, generator = _gan_parts()
    gan = GAN(discriminator, generator)
    gan.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01),
                keras.losses.BinaryCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((_rows(22, 6, 0), _rows(22, LATENT, 1))).batch(8)
    history = gan.fit(data, epochs=2, verbose=0).history
    return (history["d_loss"] + history["g_loss"],
            _values(discriminator, generator, gan.d_optimizer, gan.g_optimizer, *gan.metrics))


def gan_loop():
    """The guide's GAN step (latent vectors passed in), two steps per batch."""
    discriminator, generator = _gan_parts()
    d_optimizer, g_optimizer = keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def train_step(real_images, random_latent_vectors):
        generated_images = generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((tf.shape(real_images)[0], 1)),
                            tf.zeros((tf.shape(real_images)[0], 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = loss_fn(labels, discriminator(combined_images))
        grads = tape.gradient(d_loss, discriminator.trainable_weights)
        d_optimizer.apply_gradients(zip(grads, discriminator.trainable_weights))
        misleading_labels = tf.zeros((tf.shape(real_images)[0], 1))
        with tf.GradientTape() as tape:
            g_loss = loss_fn(misleading_labels, discriminator(generator(random_latent_vectors)))
        grads = tape.gradient(g_loss, generator.trainable_weights)
        g_optimizer.apply_gradients(zip(grads, generator.trainable_weights))
        return d_loss, g_loss

    real, latent = _rows(20, 6, 0), _rows(20, LATENT, 1)
    logged = [train_step(real[i:i + 10], latent[i:i + 10]) for i in (0, 10, 0)]
    return (np.asarray(logged),
            _values(discriminator, generator, d_optimizer, g_optimizer))


class Sampling(keras.layers.Layer):
    """The VAE's sampling layer, with its noise made fixed."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        return z_mean + tf.exp(0.5 * z_log_var) * 0.1


class VAE(keras.Model):
    """keras-io's VAE with its three trackers, as written."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = tf.reduce_mean(tf.reduce_sum(
                keras.losses.binary_crossentropy(data[:, :, None], reconstruction[:, :, None]),
                axis=1))
            kl_loss = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
            kl_loss = tf.reduce_mean(tf.reduce_sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def vae(batch: int):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, "relu")(inputs)
    z_mean, z_log_var = keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    decoder = _dense_net(2, 8, 6, "sigmoid")
    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    history = model.fit(_rows(3 * batch, 6, 2), epochs=2, batch_size=batch, verbose=0).history
    return (history["loss"] + history["reconstruction_loss"] + history["kl_loss"],
            _values(encoder, decoder, model.optimizer, *model.metrics))


class PositionalEmbedding(keras.layers.Layer):
    """keras-io's English-to-Spanish PositionalEmbedding: its mask marks the
    tokens that are not padding."""

    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = keras.layers.Embedding(vocab_size, embed_dim)
        self.position_embeddings = keras.layers.Embedding(sequence_length, embed_dim)

    def call(self, inputs):
        positions = tf.range(start=0, limit=tf.shape(inputs)[-1], delta=1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return tf.math.not_equal(inputs, 0)


class TransformerEncoder(keras.layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([keras.layers.Dense(dense_dim, activation="relu"),
                                            keras.layers.Dense(embed_dim)])
        self.layernorm_1 = keras.layers.LayerNormalization()
        self.layernorm_2 = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = tf.cast(mask[:, tf.newaxis, :], dtype="int32") if mask is not None else None
        attention_output = self.attention(query=inputs, value=inputs, key=inputs,
                                          attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        return self.layernorm_2(proj_input + self.dense_proj(proj_input))


class TransformerDecoder(keras.layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential([keras.layers.Dense(latent_dim, activation="relu"),
                                            keras.layers.Dense(embed_dim)])
        self.layernorm_1 = keras.layers.LayerNormalization()
        self.layernorm_2 = keras.layers.LayerNormalization()
        self.layernorm_3 = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, encoder_outputs, mask=None):
        causal_mask = self.get_causal_attention_mask(inputs)
        padding_mask = None
        if mask is not None:
            padding_mask = tf.cast(mask[:, tf.newaxis, :], dtype="int32")
            padding_mask = tf.minimum(padding_mask, causal_mask)
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs,
                                              attention_mask=causal_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs,
                                              key=encoder_outputs, attention_mask=padding_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))

    def get_causal_attention_mask(self, inputs):
        input_shape = tf.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = tf.range(sequence_length)[:, tf.newaxis]
        j = tf.range(sequence_length)
        mask = tf.cast(i >= j, dtype="int32")
        mask = tf.reshape(mask, (1, input_shape[1], input_shape[1]))
        mult = tf.concat([tf.expand_dims(batch_size, -1), tf.constant([1, 1], dtype=tf.int32)],
                         axis=0)
        return tf.tile(mask, mult)


def _padded_tokens(count: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """Token ids in [1, vocab), each row padded with 0 after a random length."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, vocab, size=(count, length))
    tokens[np.arange(length)[None, :] >= rng.randint(2, length + 1, size=count)[:, None]] = 0
    return tokens


def seq2seq_fit():
    sequence_length, vocab_size, embed_dim, latent_dim, num_heads = 6, 15, 8, 16, 2
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    encoded_seq_inputs = keras.Input(shape=(None, embed_dim), name="decoder_state_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)(x, encoded_seq_inputs)
    x = keras.layers.Dropout(0.0)(x)  # 0.5 in the example: random draws differ per replica
    decoder_outputs = keras.layers.Dense(vocab_size, activation="softmax")(x)
    decoder = keras.Model([decoder_inputs, encoded_seq_inputs], decoder_outputs)
    transformer = keras.Model([encoder_inputs, decoder_inputs],
                              decoder([decoder_inputs, encoder_outputs]), name="transformer")
    transformer.compile(keras.optimizers.RMSprop(0.01), loss="sparse_categorical_crossentropy",
                        metrics=["accuracy"])
    english = _padded_tokens(22, sequence_length, vocab_size, 3)
    spanish = _padded_tokens(22, sequence_length + 1, vocab_size, 4)
    data = tf.data.Dataset.from_tensor_slices((
        {"encoder_inputs": english, "decoder_inputs": spanish[:, :-1]}, spanish[:, 1:])).batch(8)
    history = transformer.fit(data, epochs=2, verbose=0).history
    return (history["loss"] + history["accuracy"],
            _values(transformer, transformer.optimizer, *transformer.metrics))


def masked_loop():
    """Token losses summed under the mask, divided by the mask's sum; a loss
    tracker and a masked accuracy."""
    vocab, length = 12, 5
    model = keras.Sequential([keras.Input((length,), dtype="int64"),
                              keras.layers.Embedding(vocab, 8, mask_zero=True),
                              keras.layers.Dense(8, "relu"), keras.layers.Dense(vocab)])
    optimizer = keras.optimizers.Adam(0.01)
    tracker, accuracy = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x)
            mask = tf.cast(tf.not_equal(y, 0), tf.float32)
            losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.reduce_sum(losses * mask) / tf.reduce_sum(mask)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        tracker.update_state(loss)
        accuracy.update_state(y, logits, sample_weight=mask)
        return loss, tracker.result(), accuracy.result()

    tokens = _padded_tokens(20, length + 1, vocab, 5)
    logged = [step(tokens[i:i + 10, :-1], tokens[i:i + 10, 1:]) for i in (0, 10, 0)]
    return np.asarray(logged), _values(model, optimizer, tracker, accuracy)


def _regressor():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])


def static_batch():
    """The guide's GAN reads ``real_images.shape[0]``: a step building a tensor
    of its batch's size from the static shape."""
    model, optimizer = _regressor(), keras.optimizers.SGD(0.1)

    @tf.function
    def step(x):
        batch_size = x.shape[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - tf.ones((batch_size, 3))))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    rows = _rows(8, 6, 6)
    return [step(rows) for _ in range(3)], _values(model, optimizer)


def fixed_block():
    """A step concatenating 4 rows it makes (a fixed count, not the batch's)
    with the batch's rows."""
    model, generator = _regressor(), _dense_net(LATENT, 8, 6)
    optimizer = keras.optimizers.SGD(0.1)
    latent = tf.constant(_rows(4, LATENT, 8))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            rows = tf.concat([generator(latent), x], axis=0)
            loss = tf.reduce_mean(tf.square(model(rows)))
        variables = model.trainable_variables + generator.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    rows = _rows(8, 6, 6)
    return [step(rows) for _ in range(3)], _values(model, generator, optimizer)


# scenario -> (train, tfpar config besides the device count)
SCENARIOS = {"gan_fit": (gan_fit, {}), "gan_loop": (gan_loop, {}),
             "vae_even": (lambda: vae(16), {}), "vae_uneven": (lambda: vae(10), {}),
             "seq2seq_fit": (seq2seq_fit, {}), "masked_loop": (masked_loop, {}),
             "static_batch": (static_batch, {}), "fixed_block": (fixed_block, {})}
