/* Minimal C test macros: each failed check prints file:line and the
 * expression, the test keeps going, and main returns non-zero at the end. */
#pragma once
#include <math.h>
#include <stdio.h>
#include <string.h>

static int check_failures = 0;
static int check_count = 0;

#define CHECK(cond)                                                                   \
    do {                                                                              \
        check_count++;                                                                \
        if (!(cond)) {                                                                \
            check_failures++;                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);  \
        }                                                                             \
    } while (0)

#define CHECK_OK(expr)                                                                       \
    do {                                                                                     \
        check_count++;                                                                       \
        int check_status_ = (int)(expr);                                                     \
        if (check_status_ != 0) {                                                            \
            check_failures++;                                                                \
            fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #expr,        \
                    check_status_, mrl_last_error());                                        \
        }                                                                                    \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                  \
    do {                                                                                       \
        check_count++;                                                                         \
        double check_a_ = (a), check_b_ = (b);                                                 \
        if (!(fabs(check_a_ - check_b_) <= (tol))) {                                           \
            check_failures++;                                                                  \
            fprintf(stderr, "%s:%d: %s = %.9g, expected %s = %.9g (tolerance %g)\n", __FILE__, \
                    __LINE__, #a, check_a_, #b, check_b_, (double)(tol));                      \
        }                                                                                      \
    } while (0)

#define CHECK_STR_CONTAINS(haystack, needle)                                                      \
    do {                                                                                          \
        check_count++;                                                                            \
        const char *check_h_ = (haystack);                                                        \
        if (!check_h_ || !strstr(check_h_, (needle))) {                                           \
            check_failures++;                                                                     \
            fprintf(stderr, "%s:%d: \"%s\" does not contain \"%s\"\n", __FILE__, __LINE__,       \
                    check_h_ ? check_h_ : "(null)", (needle));                                    \
        }                                                                                         \
    } while (0)

#define CHECK_DONE()                                                                          \
    do {                                                                                      \
        printf("%s: %d checks, %d failed\n", __FILE__, check_count, check_failures);          \
        return check_failures ? 1 : 0;                                                        \
    } while (0)
