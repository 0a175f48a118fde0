/* SipHash-2-4 (fiv_mac.c): the MAC of introductions. Self-contained, so
   that its test can build it alone. */
#ifndef FIV_MAC_H
#define FIV_MAC_H

#include <stddef.h>
#include <stdint.h>

#define FIV_KEY_LEN 16

uint64_t fiv_mac(const uint8_t key[FIV_KEY_LEN], const void *in, size_t len);

#endif
