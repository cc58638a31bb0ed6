"""tfmp.pipeline.balance splits layers into stages of least bottleneck cost."""

import keras
import numpy as np
import pytest

from tfmp.pipeline.balance import balance, stage_costs


def dense_chain():
    """Dense layers 4->4->8->8->4->2: 20, 40, 72, 36 and 10 parameters."""
    widths = [4, 4, 8, 8, 4, 2]
    layers = []
    for i, (fan_in, units) in enumerate(zip(widths, widths[1:])):
        layer = keras.layers.Dense(units, name=f"d{i}")
        layer.build((None, fan_in))
        layers.append(layer)
    return layers


def names(groups):
    return [[layer.name for layer in group] for group in groups]


def test_params_split_is_the_one_found_by_hand():
    layers = dense_chain()
    assert stage_costs([[layer] for layer in layers]) == [20, 40, 72, 36, 10]
    # 2 stages: 60 | 118 beats 20 | 158 and 132 | 46 and 168 | 10.
    two = balance(layers, 2)
    assert names(two) == [["d0", "d1"], ["d2", "d3", "d4"]]
    assert stage_costs(two) == [60, 118]
    # 3 stages: the 72-parameter layer alone bounds any split from below.
    three = balance(layers, 3)
    assert names(three) == [["d0", "d1"], ["d2"], ["d3", "d4"]]
    assert stage_costs(three) == [60, 72, 46]


def test_one_stage_and_one_layer_per_stage():
    layers = dense_chain()
    assert names(balance(layers, 1)) == [["d0", "d1", "d2", "d3", "d4"]]
    assert names(balance(tuple(layers), 5)) == [["d0"], ["d1"], ["d2"], ["d3"], ["d4"]]


def test_ties_go_to_the_earlier_cut():
    layers = []
    for name in ("a", "b", "c"):
        layer = keras.layers.Dense(4, name=name)
        layer.build((None, 4))
        layers.append(layer)
    # 20 | 40 and 40 | 20 are equally good: the first cut comes earliest.
    assert names(balance(layers, 2)) == [["a"], ["b", "c"]]


def test_sequential_model_by_params_and_by_flops():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, name="conv"),  # 112 params, 2*108*36 FLOPs
            keras.layers.Flatten(name="flat"),  # 0 params, 144 FLOPs
            keras.layers.Dense(32, name="fc"),  # 4640 params, 2*4608 FLOPs
            keras.layers.Dense(10, name="head"),  # 330 params, 2*320 FLOPs
        ]
    )
    assert stage_costs([[layer] for layer in model.layers], by="flops") == [7776, 144, 9216, 640]
    by_params = balance(model, 2)
    assert names(by_params) == [["conv", "flat", "fc"], ["head"]]
    assert stage_costs(by_params) == [4752, 330]
    by_flops = balance(model, 2, by="flops")
    assert names(by_flops) == [["conv", "flat"], ["fc", "head"]]
    assert stage_costs(by_flops, by="flops") == [7920, 9856]


def test_functional_model_skips_its_input_layer():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="out")(hidden)
    model = keras.Model(inputs, outputs)
    assert names(balance(model, 2)) == [["hidden"], ["out"]]
    with pytest.raises(ValueError, match="has only 2 layers; use at most 2 stages"):
        balance(model, 3)


def test_flops_of_dense_on_3d_input_and_conv2d():
    inputs = keras.Input((5, 3))
    dense = keras.layers.Dense(4)
    dense(inputs)
    # 3x4 kernel at each of 5 positions, 2 FLOPs per multiply-add.
    assert stage_costs([[dense]], by="flops") == [2 * 12 * 5]
    conv = keras.layers.Conv2D(4, 3)
    conv(keras.Input((8, 8, 3)))
    # 3x3x3x4 kernel at each of the 6x6 valid output positions.
    assert stage_costs([[conv]], by="flops") == [2 * 108 * 36]


def test_flops_of_embedding_attention_and_einsum_dense():
    embedding = keras.layers.Embedding(10, 6)
    embedding(keras.Input((7,), dtype="int32"))
    sequence = keras.Input((6, 16))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    attended = attention(sequence, sequence)
    einsum = keras.layers.EinsumDense("abc,cde->abde", output_shape=(6, 2, 8))
    einsum(attended)
    # Embedding: one copy per output value, 7 x 6.
    # Attention: kernels 3 x 16x2x8 + 2x8x16 = 1024 over 6 positions, plus
    # scores and weighted values 4 x 6^2 x 2 heads x 8.
    # EinsumDense: its 16x2x8 kernel makes (2, 8) per position, 6 positions.
    assert stage_costs([[embedding], [attention], [einsum]], by="flops") == [
        42,
        2 * 1024 * 6 + 4 * 36 * 2 * 8,
        2 * 256 * 6,
    ]


def test_eager_layers_chain_their_shapes():
    first, relu, second = keras.layers.Dense(4), keras.layers.ReLU(), keras.layers.Dense(2)
    second(relu(first(np.zeros((2, 3, 5), "float32"))))
    # The ReLU recorded no shape when called eagerly: it takes the Dense's.
    assert stage_costs([[first], [relu, second]], by="flops") == [2 * 20 * 3, 12 + 2 * 8 * 3]


def test_containers_and_wrappers_sum_their_layers():
    inner = keras.Sequential([keras.Input((3, 5)), keras.layers.Dense(4), keras.layers.ReLU()])
    assert stage_costs([[inner]], by="flops") == [2 * 20 * 3 + 12]
    assert stage_costs([[inner]]) == [24]
    wrapped = keras.layers.TimeDistributed(keras.layers.Dense(4))
    wrapped(keras.Input((5, 3)))
    # The inner Dense was built per time step; the wrapper runs it 5 times.
    assert stage_costs([[wrapped]], by="flops") == [2 * 12 * 5]


@pytest.mark.parametrize(
    ("num_stages", "match"),
    [(0, "num_stages=0"), (-1, "num_stages=-1"), (6, "has only 5 layers; use at most 5 stages")],
)
def test_bad_num_stages(num_stages, match):
    with pytest.raises(ValueError, match=match):
        balance(dense_chain(), num_stages)


def test_bad_by():
    with pytest.raises(ValueError, match="by='memory'.*'params' or 'flops'"):
        balance(dense_chain(), 2, by="memory")
    with pytest.raises(ValueError, match="by='memory'"):
        stage_costs([dense_chain()], by="memory")


def test_no_layers():
    with pytest.raises(ValueError, match="no layers"):
        balance([], 1)
    with pytest.raises(ValueError, match="no layers"):
        balance(keras.Sequential([keras.Input((4,))]), 1)


def test_layer_given_twice():
    layers = dense_chain()
    with pytest.raises(ValueError, match="'d1' appears twice \\(positions 1 and 5\\)"):
        balance(layers + [layers[1]], 2)


def test_not_a_layer():
    with pytest.raises(TypeError, match="Entry 1 is a str"):
        balance([dense_chain()[0], "dense"], 1)


def test_unbuilt_layers():
    with pytest.raises(ValueError, match="'late' is not built.*build the model first"):
        balance([keras.layers.Dense(4, name="late")], 1)
    model = keras.Sequential([keras.layers.Dense(4, name="no_input")])
    with pytest.raises(ValueError, match="'no_input' is not built.*keras.Input"):
        balance(model, 1, by="flops")


def test_flops_need_a_known_shape():
    with pytest.raises(ValueError, match="'lonely' has no known input or output shape"):
        balance([keras.layers.ReLU(name="lonely")], 1, by="flops")
    ragged = keras.Sequential([keras.Input((None, 16)), keras.layers.Dense(4, name="ragged")])
    with pytest.raises(ValueError, match="'ragged' .*unknown dimension.*fixed shape"):
        balance(ragged, 1, by="flops")
