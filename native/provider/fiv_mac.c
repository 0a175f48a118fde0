/*
 * The MAC of introductions (fiv_intro.c): SipHash-2-4 (Aumasson and
 * Bernstein, "SipHash: a fast short-input PRF", 2012), a keyed
 * pseudorandom function for short inputs, written here from that
 * description. 128-bit key, 64-bit result; checked against the paper's
 * example by tests/fiv_mac_test.c.
 */
#include <stddef.h>
#include <stdint.h>

#include "fiv_mac.h"

static inline uint64_t rotl(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

static inline uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

#define SIP_ROUND(v0, v1, v2, v3)                                             \
    do {                                                                      \
        v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);             \
        v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;                                \
        v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;                                \
        v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);             \
    } while (0)

uint64_t fiv_mac(const uint8_t key[FIV_KEY_LEN], const void *in, size_t len)
{
    const uint8_t *m = in;
    uint64_t k0 = le64(key), k1 = le64(key + 8);
    uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
    size_t whole = len & ~(size_t)7;
    for (size_t i = 0; i < whole; i += 8) {
        uint64_t w = le64(m + i);
        v3 ^= w;
        SIP_ROUND(v0, v1, v2, v3);
        SIP_ROUND(v0, v1, v2, v3);
        v0 ^= w;
    }
    uint64_t last = (uint64_t)(len & 0xff) << 56;
    for (size_t i = 0; i < (len & 7); i++)
        last |= (uint64_t)m[whole + i] << (8 * i);
    v3 ^= last;
    SIP_ROUND(v0, v1, v2, v3);
    SIP_ROUND(v0, v1, v2, v3);
    v0 ^= last;
    v2 ^= 0xff;
    for (int i = 0; i < 4; i++)
        SIP_ROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}
