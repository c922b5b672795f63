// sluice's web page: settings, the header, and the two views (chat.js, experts.js).
import { $, SETTINGS, api, errorText, forgetKey, loadSettings } from './util.js';
import { initChat } from './chat.js';
import { initExperts } from './experts.js';

function settingsDialog(onSave) {
  const dialog = $('#settings');
  const field = (id) => $(`#set-${id}`);
  $('#open-settings').addEventListener('click', () => {
    const s = loadSettings();
    field('temperature').value = s.temperature;
    field('top-p').value = s.top_p;
    field('max-tokens').value = s.max_tokens;
    field('thinking').checked = s.thinking;
    field('tools').checked = s.tools;
    field('system').value = s.system;
    field('extra').value = s.extra;
    $('#settings-error').textContent = '';
    dialog.showModal();
  });
  $('#save-settings').addEventListener('click', (e) => {
    const extra = field('extra').value.trim();
    if (extra) {
      try {
        const v = JSON.parse(extra);
        if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new Error('not an object');
      } catch (err) {
        e.preventDefault();
        $('#settings-error').textContent = `Extra request fields: not a JSON object (${err.message})`;
        return;
      }
    }
    localStorage.setItem(SETTINGS, JSON.stringify({
      temperature: field('temperature').value,
      top_p: field('top-p').value,
      max_tokens: field('max-tokens').value,
      thinking: field('thinking').checked,
      tools: field('tools').checked,
      system: field('system').value,
      extra,
    }));
    onSave();
  });
  $('#forget-key').addEventListener('click', forgetKey);
}

async function showModel() {
  try {
    const r = await api('/v1/models');
    if (!r.ok) throw new Error(await errorText(r));
    const m = (await r.json()).data[0];
    $('#model-name').textContent = `${m.id} · ${m.max_model_len} tokens of context`;
  } catch (e) {
    $('#model-name').textContent = e.message;
  }
}

const experts = initExperts();
initChat();
settingsDialog(() => {});
$('#toggle-sidebar').addEventListener('click', () => document.body.classList.toggle('no-sidebar'));
$('#toggle-experts').addEventListener('click', (e) => {
  const on = document.body.classList.toggle('show-experts');
  e.currentTarget.setAttribute('aria-pressed', String(on));
  experts.setVisible(on);
});
showModel();
