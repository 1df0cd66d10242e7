import numpy as np

from coordinator.engine.sampling import FALLBACK_SAMPLING, fallback_sampling, target_distribution

IDS = np.array([7, 3, 9, 1], dtype=np.int32)
LOGPROBS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def choose_token(ids: np.ndarray, logprobs: np.ndarray, temperature: float, top_p: float,
                 rng: np.random.Generator) -> int:
    """One draw from ``target_distribution``, as plain decoding makes it."""
    return target_distribution(ids, logprobs, temperature, top_p).sample(rng)


def test_greedy_takes_best():
    assert choose_token(IDS, LOGPROBS, 0.0, 1.0, np.random.default_rng(0)) == 7


def test_seeded_sampling_is_reproducible():
    def draws(seed: int, temperature: float = 1.0) -> list[int]:
        rng = np.random.default_rng(seed)
        return [choose_token(IDS, LOGPROBS, temperature, 1.0, rng) for _ in range(50)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6), "the rng (seed) must drive the choice"
    assert draws(5) != draws(5, temperature=0.0) == [7] * 50, "temperature > 0 must sample, 0 is greedy"


def test_sampling_follows_distribution_and_top_p():
    rng = np.random.default_rng(0)
    draws = [choose_token(IDS, LOGPROBS, 1.0, 1.0, rng) for _ in range(20000)]
    freq = {t: draws.count(t) / len(draws) for t in IDS.tolist()}
    assert abs(freq[7] - 0.5) < 0.02 and abs(freq[1] - 0.05) < 0.01
    # top_p 0.8 keeps only the two best (0.5 + 0.3)
    draws = {choose_token(IDS, LOGPROBS, 1.0, 0.8, rng) for _ in range(2000)}
    assert draws == {7, 3}


def test_low_temperature_sharpens():
    rng = np.random.default_rng(0)
    draws = [choose_token(IDS, LOGPROBS, 0.1, 1.0, rng) for _ in range(1000)]
    assert draws.count(7) > 990


def test_fallback_sampling_only_for_a_model_without_its_own():
    assert fallback_sampling({}) == FALLBACK_SAMPLING == {"temperature": 0.0, "frequency_penalty": 0.3}
    assert fallback_sampling({"top_p": 0.9, "max_tokens": 64}) == FALLBACK_SAMPLING
    assert fallback_sampling({"temperature": 0.7}) == {} == fallback_sampling({"repetition_penalty": 1.1})
    served = fallback_sampling({})
    served["temperature"] = 1.0
    assert FALLBACK_SAMPLING["temperature"] == 0.0, "each caller gets its own copy"
