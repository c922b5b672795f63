// What the page's modules share: settings, the API key, fetch with the key.

export const SETTINGS = 'sluice.settings';
const API_KEY = 'sluice.apiKey';
const DEFAULTS = {
  temperature: '', top_p: '', max_tokens: '', thinking: true, tools: true, system: '', extra: '',
};

export const $ = (sel) => document.querySelector(sel);

export function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(SETTINGS) || '{}') };
  } catch {
    return { ...DEFAULTS };
  }
}

let apiKey = localStorage.getItem(API_KEY) || '';

export function forgetKey() {
  apiKey = '';
  localStorage.removeItem(API_KEY);
}

/** Asks for the API key; resolves when one is given, rejects when the dialog is dismissed. */
function askKey(why) {
  const dialog = $('#key-dialog');
  $('#key-error').textContent = why;
  $('#key-input').value = '';
  return new Promise((resolve, reject) => {
    dialog.addEventListener('close', () => {
      const key = $('#key-input').value.trim();
      if (dialog.returnValue === 'ok' && key) {
        apiKey = key;
        localStorage.setItem(API_KEY, key);
        resolve();
      } else {
        reject(new Error('this server needs an API key (sluice serve --api-key)'));
      }
    }, { once: true });
    dialog.showModal();
  });
}

/** fetch() with the API key; a 401 asks for the key and tries again. */
export async function api(path, init = {}) {
  for (;;) {
    const headers = { ...(init.headers || {}) };
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    await askKey(apiKey ? 'That key was not accepted.' : '');
  }
}

/** An error body's message (OpenAI's shape), else the status. */
export async function errorText(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message || text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}


/** Bytes as people read them: 4.2 MB, 12.9 GB (powers of 1000, as the command line says them). */
export function formatBytes(n) {
  if (n == null) return '–';
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i += 1;
  }
  return `${n.toFixed(i && n < 100 ? 1 : 0)} ${units[i]}`;
}
