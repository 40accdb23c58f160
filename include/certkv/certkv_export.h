/* certkv export macro.
 *
 * libcertkv is compiled with hidden visibility (-fvisibility=hidden) and a linker version script
 * (src/api/certkv.map); CERTKV_API marks the functions of the C API, the only symbols the shared
 * library exports. A consumer's declarations carry the same attribute, harmless on an undefined
 * symbol, so one header serves the library, its consumers and its static builds alike.
 */
#ifndef CERTKV_CERTKV_EXPORT_H_
#define CERTKV_CERTKV_EXPORT_H_

#if defined(__GNUC__) || defined(__clang__)
#define CERTKV_API __attribute__((visibility("default")))
#else
#define CERTKV_API
#endif

#endif /* CERTKV_CERTKV_EXPORT_H_ */
